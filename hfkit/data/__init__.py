"""Data pipeline: parsers, features, MSA sampling, cropping, record store, preprocessing, datasets."""
