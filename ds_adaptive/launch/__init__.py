"""Starting and stopping jobs: the signal-safe supervisor around DeepSpeed's launcher, start-up checks, and
multi-node runs without ssh (``multinode``).
"""
