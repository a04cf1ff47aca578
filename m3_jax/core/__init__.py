"""The leaf of the house: the mesh, the logical-axis table and `constrain` (sharding.py), and the batch contract
(batch.py). Nothing in here imports the rest of the project; models, data, interop and train all import it."""
