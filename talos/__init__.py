"""talos: the Talos peer node (docs/DESIGN.md layer 2)."""
