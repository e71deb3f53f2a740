"""How fast does a swarm train over capped, delayed and NATed links?"""
