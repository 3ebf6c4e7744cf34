"""What a session is given: the composed config, its checks, the tuning space, the results folder."""
