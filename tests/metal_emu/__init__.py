"""Linux emulation of Metal kernels (g++ + a Metal shim); see emu.py."""
