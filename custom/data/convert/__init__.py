"""Converters of public datasets' downloads into FedUQ's layout, and of FedUQ's layout into nnU-Net's raw one
(``feduq convert <dataset>``): one module per dataset, each with its ``main(argv)``."""
