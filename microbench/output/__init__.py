"""What runs leave behind: sweep records (JSONL, meta.json), the console table, training logs and
TensorBoard events written without TensorFlow."""
