"""Files Specula reads and writes: checked readers, JSON lines, output directories written atomically."""
