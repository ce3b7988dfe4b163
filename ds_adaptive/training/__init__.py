"""A run assembled once (``assemble.build_run``) and trained (``trainer``), with its collaborators:
checkpoints (``checkpoint``, ``checksum``, ``runlock``), LoRA, metrics, previews, preemption, block-fusion warm-up.
"""
