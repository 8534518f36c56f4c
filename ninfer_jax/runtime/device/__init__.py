"""What moves bytes on the device and between it and the Host: the model runner's jitted steps, the Host tier's
buffer and copies, and the prefix cache file. No scheduling or cache policy lives here."""
