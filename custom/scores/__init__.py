"""How a segmentation is scored, no FLARE and no method: Dice and HD95 (MONAI's, with the papers' conventions), a
network's output made into a segmentation and its uncertainty maps, per-case scores of images and volumes, the
results tables, and how well uncertainty tells errors apart."""
