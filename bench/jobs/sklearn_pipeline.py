"""scikit-learn: StandardScaler + PCA + KMeans on a dense float64 matrix.

400k samples x 60 features (192 MB): a fit with preprocessing, as a
feature-engineering step of a model-training job would run it.
"""
import numpy as np
from sklearn.cluster import KMeans
from sklearn.decomposition import PCA
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler


def run(scale=1.0):
    rng = np.random.default_rng(12)
    n, d = int(400_000 * scale), 60
    centers = rng.normal(0, 5, (8, d))
    X = centers[rng.integers(0, 8, n)] + rng.normal(0, 1, (n, d))
    pipe = make_pipeline(StandardScaler(), PCA(n_components=12, random_state=0),
                         KMeans(n_clusters=8, n_init=1, max_iter=60, random_state=0))
    labels = pipe.fit_predict(X)
    km = pipe[-1]
    return float(km.inertia_) + float(np.bincount(labels).max())
