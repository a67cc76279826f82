"""talos: the Talos peer node (DESIGN.md layer 2)."""
