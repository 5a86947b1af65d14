"""stabletrain's tools inside the trainers people already use.

``lightning.StabletrainCallback`` (PyTorch Lightning), ``transformers.StabletrainCallback``
(Hugging Face Trainer) and ``accelerate.StepMonitor`` (Accelerate loops) run the plain-loop tools
at the framework's own points of a step; ``common.StepTools`` holds what they share. The
submodules import their framework, this package imports nothing. See docs/integrations/.
"""
