"""How the policy's weights reach the generators: shared_memory.py (slots in shared memory, one machine)."""
