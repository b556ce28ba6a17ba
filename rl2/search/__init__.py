"""Tree search for step-by-step solutions (rStar-Math): MCTS, step-level beam search and best-of-N
with a policy, a sandbox for each step's code and a process preference model; see `rl2.search.run`."""
