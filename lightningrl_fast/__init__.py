"""lightningrl_fast: fast LightningRL post-training and decoding for block-wise diffusion LLMs (SDAR/TraDo).

Nothing is re-exported here: import from the modules (sampler, model, ops.<op>, rl.trainer, ...); ARCHITECTURE.md
is the map.
"""

__version__ = "0.1.0"
