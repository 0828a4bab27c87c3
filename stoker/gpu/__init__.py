"""The GPU targets: TensorRT-LLM engine (`tensorrt`) and LLM-API (`pytorch`).

Nothing here imports torch or TensorRT-LLM: commands and configs are rendered as
data, checked by contract against the 1.2-era upstream extracts (tests/contract),
and executed on a GPU host inside the pinned serving image (stoker.containers.execute).
Keep this package import-light: the in-image worker imports it too.
"""
