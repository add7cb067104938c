"""lightningrl_fast: fast LightningRL post-training and decoding for block-wise diffusion LLMs (SDAR/TraDo).

Public names are re-exported here as the layers land; see ARCHITECTURE.md for the map.
"""

__version__ = "0.1.0"
