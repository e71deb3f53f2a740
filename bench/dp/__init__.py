"""Does training still learn when replicas average rarely, compressed, or through a subspace?"""
