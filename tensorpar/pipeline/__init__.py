"""Pipeline parallelism: stages of a dense model on a group of ranks, run over microbatches.

`pipeline` cuts an ``nn.Sequential``, a transformers causal LM or a model that lists its
own blocks (``pipeline_blocks()``) into contiguous stages, keeps this rank's, and returns a
`Pipeline` whose ``step`` runs a schedule (GPipe, 1F1B, interleaved 1F1B). Stages hand
activations over with `send` / `recv`, point-to-point autograd Functions whose backward is
their mirror.
"""

from tensorpar.pipeline.p2p import NothingSent, recv, send
from tensorpar.pipeline.pipe import Pipeline, StepFailed, pipeline
from tensorpar.pipeline.replicas import average_gradients
from tensorpar.pipeline.schedules import Action, bubble_fraction, build_schedule, render

__all__ = ["Action", "NothingSent", "Pipeline", "StepFailed", "average_gradients",
           "bubble_fraction", "build_schedule", "pipeline", "recv", "render", "send"]
