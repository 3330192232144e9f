"""FFT image pipeline: a batch of images filtered in the frequency domain.

Each 2048x2048 float32 image: fft2 (complex128, 64 MiB), a Gaussian low-pass
mask, ifft2, magnitude, normalisation and a histogram. The big temporaries
of every step have the same sizes image after image.
"""
import numpy as np


def run(scale=1.0):
    n = 2048
    count = max(1, int(6 * scale))
    rng = np.random.default_rng(14)
    fy = np.fft.fftfreq(n)[:, None]
    fx = np.fft.fftfreq(n)[None, :]
    mask = np.exp(-(fx * fx + fy * fy) / (2 * 0.05 ** 2))
    total = 0.0
    for _ in range(count):
        img = rng.random((n, n), dtype=np.float32)
        img += np.sin(np.arange(n, dtype=np.float32) / 17.0)[None, :]
        spec = np.fft.fft2(img)
        low = np.abs(np.fft.ifft2(spec * mask))
        low = (low - low.mean()) / low.std()
        hist, _ = np.histogram(low, bins=64, range=(-4, 4))
        total += float(hist.argmax()) + float(low[::97, ::89].sum())
    return total
