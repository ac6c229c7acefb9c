"""Multi-turn environments: the contract (``dora.envs.base``) and the built-in ones (``calculator``, ``guess``)."""

from dora.envs.base import Answer, EnvError, answer, messages, resolve

__all__ = ["Answer", "EnvError", "answer", "messages", "resolve"]
