"""What runs inside the broker's processes: the pure cores the stage shells feed.

``lifecycle`` decides what the supervisor does when a stage process ends;
``names`` maps AMQP names (any UTF-8 up to 255 bytes) to safe file names.
"""
