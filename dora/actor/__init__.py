"""What the three processes share around their actors: the rollout worker's and the learner's session with the broker
(``session``), liveness (``liveness``), CURVE keys (``security``), ``ClusterInfo`` (the one reader of Slurm's
variables), the broker's discovery file (``discovery``), the event loop's lag probe (``lag``) and the signals at the
end of a process's life (``signals``). The actors themselves live in their process's package."""
