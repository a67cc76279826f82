"""talos: the Talos peer node (docs/DESIGN.md layer 2)."""

__version__ = "0.1.0"
