"""SciPy: a 2-D Poisson problem solved with conjugate gradients, then smoothed.

A 5-point Laplacian on a 900x900 grid (810k unknowns, sparse CSR), CG to a
fixed iteration count, then scipy.ndimage filters on the solution: each CG
step makes several 6.5 MB temporaries.
"""
import numpy as np
import scipy.ndimage as ndi
import scipy.sparse as sp
import scipy.sparse.linalg as spla


def run(scale=1.0):
    m = int(900 * scale ** 0.5)
    one = np.ones(m)
    T = sp.diags([-one[:-1], 4 * one, -one[:-1]], [-1, 0, 1], format="csr")
    S = sp.diags([-one[:-1], -one[:-1]], [-1, 1], format="csr")
    A = (sp.kron(sp.identity(m, format="csr"), T) + sp.kron(S, sp.identity(m, format="csr"))).tocsr()
    rng = np.random.default_rng(13)
    b = rng.random(m * m)
    x, _ = spla.cg(A, b, rtol=1e-12, maxiter=350)
    img = x.reshape(m, m)
    smooth = ndi.gaussian_filter(img, 3.0)
    edges = ndi.sobel(smooth, 0) ** 2 + ndi.sobel(smooth, 1) ** 2
    return float(np.linalg.norm(A @ x - b) + edges.sum())
