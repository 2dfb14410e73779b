"""hfkit: fast AlphaFold-style (Evoformer) training and inference on GPUs.

Fused Triton ops (`hfkit.ops`), drop-in modules and one-line swapping (`hfkit.nn`,
`hfkit.to_hfkit`, `hfkit.to_torch`), and the benchmark harness (`hfkit.bench`).
"""

from hfkit.nn.convert import to_hfkit, to_torch

__version__ = "0.1.0"
__all__ = ["to_hfkit", "to_torch", "__version__"]
