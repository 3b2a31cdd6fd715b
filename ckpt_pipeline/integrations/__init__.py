"""Drop-ins for the frameworks people train with, each an optional extra:

- ``ckpt_pipeline.integrations.lightning`` (``pip install 'ckpt_pipeline[lightning]'``):
  PyTorch Lightning's ``CheckpointIO`` and an FSDP2 strategy.
- ``ckpt_pipeline.integrations.transformers`` (``[hf]``): a Hugging Face ``Trainer`` that
  checkpoints through the pipeline.
- ``ckpt_pipeline.integrations.accelerate`` (``[accelerate]``): ``save_state`` and
  ``load_state`` over an ``Accelerator``'s prepared objects.
- ``ckpt_pipeline.integrations.torchtitan``: a checkpoint manager with torchtitan's method
  names (no extra: it needs only torch).

They use only the package's public names, and nothing in the package imports them:
``import ckpt_pipeline`` never imports a framework. See ``docs/integrations.md``.
"""

__all__ = ()
