"""Many ranks on paper: plan whole epochs for N GPUs with every sampler and score them (``simulate``,
``sparse``); ``e2e`` analyses the end-to-end benchmark's measured arms.
"""
