"""
llmc/sampler.py: drawing a token (llm.c's llmc/sampler.h and llmc/rand.h): llm.c's xorshift*
RNG, so that both trainers, given the same logits, draw the same tokens as each other and as
llm.c, and the inverse-CDF draw with temperature and top-k.
"""

import numpy as np

SAMPLE_SEED = 1337                     # llm.c's sampler seed (--sample-seed)


class SamplerRNG:
    """xorshift64* (Marsaglia 2003; Vigna 2016), the RNG llm.c uses for sampling. state is a
    nonzero uint64; random_f32() returns a float in [0, 1) from the top 24 bits."""
    MASK = (1 << 64) - 1

    def __init__(self, state=SAMPLE_SEED):
        if state & self.MASK == 0:
            raise ValueError("xorshift's state must be nonzero: from 0 it draws 0 forever")
        self.state = state & self.MASK

    def random_u32(self):
        """Advance the state (xorshift: shifts 12, 25, 27) and return the top 32 bits of state * M."""
        s = self.state
        s ^= s >> 12
        s ^= (s << 25) & self.MASK
        s ^= s >> 27
        self.state = s
        return ((s * 0x2545F4914F6CDD1D) & self.MASK) >> 32

    def random_f32(self):
        """A float in [0, 1): the top 24 bits of random_u32() / 2^24."""
        return (self.random_u32() >> 8) / 16777216.0


def sample_token(logits, V, rng, temperature=1.0, top_k=0):
    """Draw one token id from logits (Vp,) restricted to the first V. temperature > 0 divides the
    logits; top_k > 0 keeps only the k most likely tokens. Uses one rng.random_f32() coin and
    inverse-CDF sampling, in float64, so it is deterministic given the logits and the RNG state."""
    z = np.asarray(logits[:V], dtype=np.float64) / max(temperature, 1e-8)
    if 0 < top_k < V:
        kth = np.partition(z, V - top_k)[V - top_k]
        z = np.where(z >= kth, z, -np.inf)
    p = np.exp(z - z.max())
    cdf = np.cumsum(p / p.sum())
    coin = rng.random_f32()
    return int(min(np.searchsorted(cdf, coin, side="right"), V - 1))

