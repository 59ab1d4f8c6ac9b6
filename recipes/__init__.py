"""Models and data modules the shipped recipes name: small, readable examples to copy.

    digits.py   a CNN on scikit-learn's 8x8 digits (recipes/digits.yaml)
    charlm.py   a character-level transformer on the Python standard library's source (recipes/charlm.yaml)
"""
