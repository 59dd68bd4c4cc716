"""A local SageMaker runtime: boto3's calls, sticky routing, local TorchServes."""
