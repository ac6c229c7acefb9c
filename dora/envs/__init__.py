"""Multi-turn environments: the contract (``dora.envs.base``) and the built-in ones."""
