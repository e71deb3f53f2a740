"""How long does the compression math take next to one decoder layer's compute?"""
