"""What runs on every node: the launcher, the node agent, the spawner of ranks and spares, node 0's supervisor process."""
