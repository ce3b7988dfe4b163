"""Runtime integrations shipped as ``ds_adaptive.patches``: DeepSpeed op registry, Megatron data
pipeline, diffusers' Wan model."""
