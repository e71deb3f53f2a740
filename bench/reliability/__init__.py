"""Does a swarm keep training, and a node keep serving, through kills, churn, long runs and hostile input?"""
