"""From a checkpoint or an export to videos (``sample``) and to a diffusers-format model (``export``).
"""
