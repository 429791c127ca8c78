"""nllb-worker's RabbitMQ side: settings, protocol v1 messages, AMQP plumbing, the job service,
the producer client, health/metrics, and the `nllb-worker` command.

asyncio only: the engine runs on its own thread (see engine/); this package never touches the GPU.
"""
