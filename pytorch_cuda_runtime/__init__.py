"""Code baked into the pytorch-cuda images: start-up banner and smoke suite.

Nothing here may import torch at module import time: the banner runs on every
container start and must stay cheap.
"""
