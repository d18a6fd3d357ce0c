"""Files copied into an exported bundle's ``scripts/`` folder and run there by MONAI's runner, without FedUQ
installed: each imports only the standard library and the packages a MONAI Bundle runs with (NumPy, torch, MONAI,
nibabel, SimpleITK, Pillow and tifffile for 2D files and, for an nnU-Net 3D bundle, nnU-Net v2). The bundle also carries two FedUQ-free modules that
live with their subject, :mod:`feduq.scores.case_scores` and :mod:`feduq.io.channel_io`."""
