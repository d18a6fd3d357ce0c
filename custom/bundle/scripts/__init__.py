"""Files copied into an exported bundle's ``scripts/`` folder and run there by MONAI's runner, without FedUQ
installed: each imports only the standard library, NumPy, SciPy, torch, MONAI and nibabel."""
