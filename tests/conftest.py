from __future__ import annotations

from hypothesis import Phase, settings

# Used by tests/mutation.py: a failing property run should stop at the first counterexample, not shrink it.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate], database=None)
