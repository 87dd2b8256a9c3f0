"""The mstar Kubernetes operator: MStarDeployment -> engine Deployment, Service, ConfigMap, HPA."""
