"""FDP: lifetime classes, placement, nvme-cli discovery, passthrough writes, FTL model."""
