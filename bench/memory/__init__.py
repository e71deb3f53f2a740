"""How much memory does a node hold for its stage, against the estimate it claims the stage with?"""
