"""A stage's side of moving weights: a trainer's tensors received without disk (``sync``: the
session, ``transports``: one class per way tensors arrive, ``staging``: where they wait,
``ipc``: shared-memory handles, ``checks``: what is refused before anything is applied). The
AR stage's tensor-parallel ranks add ``omnistage.stage.ar.tp_weights``; the trainer's side is
``omnistage.rl``."""
