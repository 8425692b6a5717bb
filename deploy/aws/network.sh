#!/usr/bin/env bash
# Creates what ray_cluster.yaml expects before `ray up`, then prints the values for its `metadata.edit`:
#   - one security group for every node: all traffic within the group, inbound and outbound (EFA needs both:
#     https://docs.aws.amazon.com/pcs/latest/userguide/working-with_networking_efa_create-sg.html), and SSH
#     (22) from ADMIN_CIDR only (the machine that runs `ray`: a bastion in the VPC, or your VPN's range);
#   - the cluster placement group ray-$CLUSTER_NAME that the 8-GPU nodes launch into;
#   - an EFS file system (encrypted, elastic throughput) with a mount target in the subnet;
#   - the ECR repository `planner` for the image of deploy/Dockerfile;
#   - instance profiles ray-$CLUSTER_NAME-head (Ray's autoscaler: EC2, passing the worker role, resolving the
#     AMI's public SSM parameter; pulling the image) and ray-$CLUSTER_NAME-node (pulling the image).
#
#   ADMIN_CIDR=10.0.0.10/32 VPC_ID=vpc-... SUBNET_ID=subnet-... bash deploy/aws/network.sh
#
# SUBNET_ID: a private subnet (every node's addresses are private: a p5.48xlarge with 32 network interfaces
# gets no public IPv4 address) whose route table sends 0.0.0.0/0 to a NAT gateway, so nodes can pull the
# image and packages. Nothing is opened to 0.0.0.0/0: the dashboard, job API and MLflow listen on the head's
# 127.0.0.1 and are reached through the SSH tunnel (`ray dashboard ray_cluster.yaml`).
set -euo pipefail
: "${ADMIN_CIDR:?set ADMIN_CIDR to the address range allowed to SSH to the nodes, e.g. 10.0.0.10/32}"
: "${VPC_ID:?set VPC_ID}"
: "${SUBNET_ID:?set SUBNET_ID (private, with a NAT gateway; its availability zone holds every node)}"
REGION="${AWS_REGION:-us-east-1}"
NAME="${CLUSTER_NAME:-planner}"
case "$ADMIN_CIDR" in
  0.0.0.0/0 | ::/0) echo "refusing ADMIN_CIDR=$ADMIN_CIDR: SSH must not be open to the internet" >&2; exit 2 ;;
esac

sg=$(aws ec2 create-security-group --region "$REGION" --vpc-id "$VPC_ID" --group-name "ray-$NAME" \
  --description "Ray cluster $NAME: intra-cluster (EFA), SSH from ADMIN_CIDR" --query GroupId --output text)
aws ec2 authorize-security-group-ingress --region "$REGION" --group-id "$sg" \
  --ip-permissions "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]" \
  "IpProtocol=tcp,FromPort=22,ToPort=22,IpRanges=[{CidrIp=$ADMIN_CIDR,Description=admin-ssh}]" >/dev/null
aws ec2 authorize-security-group-egress --region "$REGION" --group-id "$sg" \
  --ip-permissions "IpProtocol=-1,UserIdGroupPairs=[{GroupId=$sg}]" >/dev/null

# Cluster placement group: the 8-GPU nodes on one low-latency, high-bisection segment of the network.
aws ec2 create-placement-group --region "$REGION" --group-name "ray-$NAME" --strategy cluster >/dev/null

fs=$(aws efs create-file-system --region "$REGION" --encrypted --performance-mode generalPurpose \
  --throughput-mode elastic --tags "Key=Name,Value=ray-$NAME" --query FileSystemId --output text)
until [ "$(aws efs describe-file-systems --region "$REGION" --file-system-id "$fs" \
  --query 'FileSystems[0].LifeCycleState' --output text)" = available ]; do sleep 5; done
aws efs create-mount-target --region "$REGION" --file-system-id "$fs" --subnet-id "$SUBNET_ID" \
  --security-groups "$sg" >/dev/null

repo=$(aws ecr create-repository --region "$REGION" --repository-name planner \
  --query repository.repositoryUri --output text)

# Instance profiles. The head's role is what Ray's own default head role holds (AmazonEC2FullAccess), plus
# iam:PassRole for the workers' role, ssm:GetParameters for the AMI's public parameter (ImageId:
# resolve:ssm:...), and reading ECR; the workers only read ECR.
trust='{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Principal":{"Service":"ec2.amazonaws.com"},"Action":"sts:AssumeRole"}]}'
for who in head node; do
  aws iam create-role --role-name "ray-$NAME-$who" --assume-role-policy-document "$trust" >/dev/null
  aws iam attach-role-policy --role-name "ray-$NAME-$who" \
    --policy-arn arn:aws:iam::aws:policy/AmazonEC2ContainerRegistryReadOnly
  aws iam create-instance-profile --instance-profile-name "ray-$NAME-$who" >/dev/null
  aws iam add-role-to-instance-profile --instance-profile-name "ray-$NAME-$who" --role-name "ray-$NAME-$who"
done
aws iam attach-role-policy --role-name "ray-$NAME-head" --policy-arn arn:aws:iam::aws:policy/AmazonEC2FullAccess
aws iam put-role-policy --role-name "ray-$NAME-head" --policy-name launch-workers --policy-document \
  '{"Version":"2012-10-17","Statement":[{"Effect":"Allow","Action":"iam:PassRole","Resource":"arn:aws:iam::*:role/ray-'"$NAME"'-node"},{"Effect":"Allow","Action":"ssm:GetParameters","Resource":"arn:aws:ssm:*::parameter/aws/service/deeplearning/*"}]}'

echo "security group: $sg   subnet: $SUBNET_ID   EFS: $fs   image: $repo:0.1.0"
echo "in ray_cluster.yaml's metadata.edit: subnet: $SUBNET_ID, security_group: $sg, efs: $fs, image: $repo:0.1.0;"
echo "in its mount command: $fs.efs.$REGION.amazonaws.com; provider.region: $REGION."
echo "then: python deploy/aws/check_cluster.py"
