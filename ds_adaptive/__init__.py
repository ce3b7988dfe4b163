"""ds_adaptive: AdaptiveLoad for DeepSpeed / Megatron video diffusion transformer training."""
__version__ = "0.1.0"
