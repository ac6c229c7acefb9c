"""`dora reward`: the reward model and the LLM judge of a run, served over HTTP as a reward service.

The workers call it with the reward service client (``dora.tasks.remote_reward``: its JSON, ids, batches and
retries); it gathers the samples of every worker's requests into batches (``batcher``), scores them with the
task's reward model and judge (``scorers``, ``judge``: the judge answers on one of dora's own engines, the torch
engine or vLLM, at its loaded weights for good) and answers each sample's components, ``model`` and
``judge``, which the workers weigh (``dora.tasks.combine``). `dora run` starts it when task.reward_model or
task.reward_judge is set.
"""
