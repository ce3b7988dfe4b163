"""Runtime integrations: DeepSpeed's op registry (``deepspeed``), Megatron's data pipeline (``megatron``),
diffusers' Wan model (``diffusers``)."""
