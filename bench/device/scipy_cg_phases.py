"""Times the phases of bench/jobs/scipy_cg.py (CSR matvec, matvec + dot, the CG solve,
the ndimage filters) and prints where its big arrays start modulo 2 MiB: the check
behind docs/performance.md, "On 16 cores". Run it under each policy:
    DATAMEM_CONFIG=configs/minimal.yaml python3 bench/device/scipy_cg_phases.py
"""
import numpy as np, time, scipy.sparse as sp, scipy.sparse.linalg as spla, scipy.ndimage as ndi
m=900; one=np.ones(m)
T=sp.diags([-one[:-1],4*one,-one[:-1]],[-1,0,1],format="csr"); S=sp.diags([-one[:-1],-one[:-1]],[-1,1],format="csr")
A=(sp.kron(sp.identity(m,format="csr"),T)+sp.kron(S,sp.identity(m,format="csr"))).tocsr()
b=np.random.default_rng(13).random(m*m)
print("A.data mod2M %x indices %x b %x" % (A.data.ctypes.data % (2<<20), A.indices.ctypes.data % (2<<20), b.ctypes.data % (2<<20)))
t=time.perf_counter(); [A@b for _ in range(200)]; print("matvec %.3f" % (time.perf_counter()-t))

t=time.perf_counter()
for _ in range(200): np.dot(A@b, b)
print("matvec+dot %.3f" % (time.perf_counter()-t))
t=time.perf_counter(); x,_=spla.cg(A,b,rtol=1e-12,maxiter=350); print("cg %.3f" % (time.perf_counter()-t))
t=time.perf_counter(); img=x.reshape(m,m); s=ndi.gaussian_filter(img,3.0); e=ndi.sobel(s,0)**2+ndi.sobel(s,1)**2; print("ndi %.3f" % (time.perf_counter()-t))
