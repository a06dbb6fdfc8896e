"""Node Feature Discovery's local feature file: gpud's node labels, for nfd-worker to publish."""
