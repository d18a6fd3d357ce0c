"""The MONAI Bundle of a trained model: 2D and declared-volume bundles (:mod:`~feduq.bundle.export`), nnU-Net 3D
bundles (:mod:`~feduq.bundle.export_3d`) and their README (:mod:`~feduq.bundle.readme`). ``scripts/`` holds the files
a bundle carries and MONAI's runner imports: they import nothing of FedUQ (a test checks it)."""
