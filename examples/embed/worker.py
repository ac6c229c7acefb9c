"""A rollout worker running this stack's own inference: a transformers model sampled token by token.

    python examples/embed/worker.py --broker broker.json --config run.toml --name w0

It is ``examples/custom_engine.py``'s worker with the stack's three methods filled in:
``generate`` samples a group from the model at the run's temperature and records each token's
log-probability under the distribution it was drawn from (what dora's loss divides by); ``loaded`` takes a published
version's weights from the weight store after checking their digest; ``reward`` scores with the run's
task and its ``task.reward``.
"""

from __future__ import annotations

import pathlib
import sys
from collections.abc import Mapping

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # examples/: custom_engine

from custom_engine import MyEngine, Request, main

from dora.config import ConfigError
from dora.config.run import RunConfig
from dora.rollout.engines.base import EngineError
from dora.store import load_verified
from dora.tasks.prompts import TaskRun


class ModelEngine(MyEngine):
    name = "embed"

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        if not cfg.rollout.model or cfg.run.top_p != 1.0:
            raise ConfigError("this engine needs rollout.model (an HF folder) and samples without top-p (run.top_p 1)")
        self.model = AutoModelForCausalLM.from_pretrained(cfg.rollout.model, dtype=torch.float32).eval()
        self.eos = self.model.config.eos_token_id
        t = cfg.task
        self.task = TaskRun(t, t.tokenizer or cfg.rollout.model)

    @torch.no_grad()
    def generate(self, batch: list[Request]) -> list[tuple[list[int], list[float]]]:
        """The batch's samples share their prefix, so they decode side by side with no padding; each draws
        from its own seeded generator, and a sample that ended keeps its row until the batch ends."""
        prefix, temperature = batch[0].prompt + batch[0].tokens, batch[0].temperature
        draws = [torch.Generator().manual_seed(r.seed) for r in batch]
        out = self.model(input_ids=torch.tensor([prefix] * len(batch)), use_cache=True)
        made: list[tuple[list[int], list[float]]] = [([], []) for _ in batch]
        ended = [False] * len(batch)
        for _ in range(batch[0].max_tokens - len(batch[0].tokens)):
            logp = torch.log_softmax(out.logits[:, -1].float() / temperature, -1)
            picks = [int(torch.multinomial(logp[i].exp(), 1, generator=g)) for i, g in enumerate(draws)]
            for i, token in enumerate(picks):
                if not ended[i]:
                    made[i][0].append(token)
                    made[i][1].append(float(logp[i, token]))
                    ended[i] = token == self.eos
            if all(ended):
                break
            out = self.model(input_ids=torch.tensor([[t] for t in picks]), past_key_values=out.past_key_values,
                             use_cache=True)  # fmt: skip
        return made

    def loaded(self, version: int, uri: str = "", sha256: str = "", keep: frozenset[int] = frozenset(),
               inline: Mapping[str, bytes] = {}) -> None:  # fmt: skip
        if uri.startswith("file://"):  # the learner's weight store; sim:// versions carry no weights
            if self.pending:
                raise EngineError(f"cannot load v{version}: {len(self.pending)} requests are waiting")
            path = pathlib.Path(uri.removeprefix("file://"))
            try:  # the published digest, checked on the open file the tensors are then read from
                state = load_verified(path, sha256, name=f"v{version}")
            except (OSError, ValueError) as e:
                raise EngineError(f"v{version} at {path}: {e}") from None
            missing, unexpected = self.model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if "rotary" not in k]:
                raise EngineError(f"v{version} does not fit the model: missing {missing[:3]}, extra {unexpected[:3]}")
        self.version = version

    def reward(self, group: int, tokens: list[int]) -> float:
        return self.task.score(group, tokens).reward  # decoded with the model's tokenizer; 0 if the reward fails


if __name__ == "__main__":
    raise SystemExit(main(ModelEngine, __doc__))
